"""Anthropic's Messages API (/v1/messages) through the official `anthropic` SDK on 127.0.0.1: a
scripted program writes the replies (text, a stop sequence, a tool call, a reasoning block, JSON),
and the route returns them as Anthropic's content blocks, whole and as its event stream, with its
stop reasons, usage and error shapes; a tool loop sends results back; the tiny model answers
/v1/messages and /v1/chat/completions alike."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.fake_program import write_fake_artifacts
from tests.scripted_program import ScriptedProgram
from tests.server.test_reasoning_server import QWEN3_TEMPLATE
from tests.tiny_model import make_tiny_tokenizer

WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CONTEXT = 512
# What the scripted model answers when the prompt holds the trigger.
REPLIES = {  # the first trigger the prompt holds wins: a tool's result before the question that called it
    "21 degrees": "It is 21 degrees in Paris.",
    "capital of France": "The capital of France is Paris.",
    "Count for me": "one, two, three STOP four, five",
    "weather in Paris": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                        '"unit": "c"}}\n</tool_call>',
    "weather, quickly": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>',
    "two cities": "".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}", "unit": "c"}}}}'
                          '\n</tool_call>\n' for city in ("Paris", "Rome")),
    "Think, then call": '<think>The tool knows.</think>\n<tool_call>\n{"name": "get_weather", "arguments": '
                        '{"city": "Oslo", "unit": "f"}}\n</tool_call>',
    "Ponder": "<think>\nSmall steps.\n</think>\n\nDone pondering.",
    "Describe Bo": '{"name":"Bo","age":7}',
    "Go on forever": "la " * 400,
}
KEY = "sk-anthropic-test"
# The SDK's own arguments no longer include the sampling fields, which the API still takes.
GREEDY = {"temperature": 0}


def scripted_server(start_fake_server, directory, template: str, **settings) -> str:
    tokenizer = make_tiny_tokenizer(384)
    write_fake_artifacts(directory, tokenizer.to_str(), {"chat_template": template, "bos_token": "<s>",
                                                         "eos_token": "</s>"}, max_seq_len=CONTEXT, pages=160)
    port, _ = start_fake_server(model_dir=directory, tool_call_parser="hermes", api_keys=(KEY,),
                                program_factory=lambda *args: ScriptedProgram(*args, replies=REPLIES), **settings)
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(start_fake_server, tmp_path_factory) -> str:
    return scripted_server(start_fake_server, tmp_path_factory.mktemp("anthropic-model"), QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def thinking(start_fake_server, tmp_path_factory) -> str:
    return scripted_server(start_fake_server, tmp_path_factory.mktemp("anthropic-thinking"), QWEN3_TEMPLATE,
                           reasoning_parser="qwen3")


def client(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def ask(url: str, text: str, **fields) -> anthropic.types.Message:
    with client(url) as sdk:
        return sdk.messages.create(model="fake", max_tokens=fields.pop("max_tokens", 200), extra_body=GREEDY,
                                   messages=fields.pop("messages", [{"role": "user", "content": text}]), **fields)


def streamed(url: str, text: str, **fields) -> tuple[list, anthropic.types.Message]:
    """The events of a streamed reply, and the message the SDK builds from them."""
    with client(url) as sdk, sdk.messages.stream(
            model="fake", max_tokens=fields.pop("max_tokens", 200), extra_body=GREEDY,
            messages=[{"role": "user", "content": text}], **fields) as stream:
        return list(stream), stream.get_final_message()


def test_a_reply_is_one_text_block_with_its_usage(served):
    message = ask(served, "What is the capital of France?", system="Be brief.")
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == "fake" and message.stop_reason == "end_turn" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "text" and block.text == REPLIES["capital of France"]
    with client(served) as sdk:
        counted = sdk.messages.count_tokens(model="fake", system="Be brief.", messages=[
            {"role": "user", "content": "What is the capital of France?"}])
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    assert usage.output_tokens == len(make_tiny_tokenizer(384).encode(block.text, add_special_tokens=False).ids) + 1  # and the end of turn
    # The same conversation as chat renders to the same tokens.
    with openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0) as chat:
        twin = chat.chat.completions.create(model="fake", max_tokens=200, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}])
    assert twin.usage.prompt_tokens == counted.input_tokens and twin.choices[0].message.content == block.text


def test_stop_sequences_max_tokens_and_the_context(served):
    message = ask(served, "Count for me", stop_sequences=["STOP", "never"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
    assert message.content[0].text == "one, two, three "
    short = ask(served, "Count for me", max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    # max_tokens past the context is cut to it, and the reply that fills it says so.
    endless = ask(served, "Go on forever", max_tokens=100_000)
    assert endless.stop_reason == "model_context_window_exceeded"
    assert endless.usage.input_tokens + endless.usage.cache_read_input_tokens + endless.usage.output_tokens == CONTEXT


def test_the_stream_builds_the_same_message(served):
    whole = ask(served, "What is the capital of France?")
    events, final = streamed(served, "What is the capital of France?")
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = httpx.post(served + "/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
        "model": "fake", "max_tokens": 50, "stream": True, "temperature": 0, "messages": [{"role": "user", "content": "Count for me"}],
        "stop_sequences": ["STOP"]})
    lines = raw.text.splitlines()
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"
    delta = json.loads(lines[lines.index("event: message_delta") + 1].removeprefix("data: "))
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}


def test_a_tool_loop(served):
    """tool_use -> tool_result -> the answer, with the SDK's own types, as an agent does."""
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = ask(served, "", messages=[question], tools=[WEATHER])
    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert text.type == "text" and text.text == "Let me look."
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input == {"city": "Paris", "unit": "c"}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees"}]}
    answer = ask(served, "", messages=[question, {"role": "assistant", "content": first.content}, result],
                 tools=[WEATHER])
    assert answer.stop_reason == "end_turn" and answer.content[0].text == REPLIES["21 degrees"]
    # The call and its result reach the template as chat's tool_calls and tool message.
    with client(served) as sdk:
        counted = sdk.messages.count_tokens(model="fake", messages=[
            question, {"role": "assistant", "content": first.content}, result], tools=[WEATHER])
    assert counted.input_tokens > ask(served, "", messages=[question], tools=[WEATHER]).usage.input_tokens


def test_parallel_calls_unless_disabled(served):
    both = ask(served, "The weather in two cities", tools=[WEATHER])
    assert [block.input["city"] for block in both.content] == ["Paris", "Rome"]
    _, one = streamed(served, "The weather in two cities", tools=[WEATHER],
                      tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [block.input["city"] for block in one.content] == ["Paris"] and one.stop_reason == "tool_use"


def test_models_as_both_sdks_list_them(served):
    with client(served) as sdk:
        [listed] = sdk.models.list().data
        assert listed.id == "fake" and listed.type == "model" and listed.created_at.year >= 2026
        assert sdk.models.retrieve("fake").display_name == "fake"
        with pytest.raises(anthropic.NotFoundError):
            sdk.models.retrieve("claude-opus-4")
    with openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0) as chat:
        assert [model.id for model in chat.models.list()] == ["fake"] and chat.models.retrieve("fake").id == "fake"


def test_a_streamed_tool_call(served):
    events, final = streamed(served, "The weather, quickly", tools=[WEATHER], tool_choice={"type": "any"})
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].input == {"city": "Paris", "unit": "c"}
    assert [e.delta.type for e in events if e.type == "content_block_delta"] == ["input_json_delta"]


def test_thinking_blocks(thinking):
    message = ask(thinking, "Ponder this")
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() == "Small steps." and message.content[1].text == "Done pondering."
    events, final = streamed(thinking, "Ponder this")
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == message.content[0].thinking
    # Thinking off reaches the template (an empty, closed think block), and the reply is all text.
    plain = ask(thinking, "Ponder this", thinking={"type": "disabled"})
    assert [block.type for block in plain.content] == ["text"]
    # An earlier turn's thinking block, sent back, is accepted and left out of the prompt.
    def history(content) -> list[dict]:
        return [{"role": "user", "content": "Ponder this"}, {"role": "assistant", "content": content},
                {"role": "user", "content": "And again?"}]

    with client(thinking) as sdk:
        counts = [sdk.messages.count_tokens(model="fake", messages=history(content)).input_tokens
                  for content in (message.content, message.content[1:])]
    assert counts[0] == counts[1]


def test_thinking_then_a_call(thinking):
    whole = ask(thinking, "Think, then call", tools=[WEATHER])
    events, final = streamed(thinking, "Think, then call", tools=[WEATHER])
    for message in (whole, final):
        assert [block.type for block in message.content] == ["thinking", "tool_use"]
        assert message.content[1].input == {"city": "Oslo", "unit": "f"} and message.stop_reason == "tool_use"
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "tool_use")]


def test_prefill_and_structured_output(served):
    prefilled = ask(served, "", messages=[{"role": "user", "content": "What is the capital of France?"},
                                          {"role": "assistant", "content": "The capital of France"}])
    assert prefilled.content[0].text == " is Paris."
    # An empty final assistant message, which Anthropic's API accepts, prefills nothing: a new turn.
    question = {"role": "user", "content": "What is the capital of France?"}
    for empty in ("", [], [{"type": "text", "text": ""}], [{"type": "thinking", "thinking": "Easy.", "signature": "s"}]):
        reply = ask(served, "", messages=[question, {"role": "assistant", "content": empty}])
        assert reply.content[0].text == REPLIES["capital of France"] and reply.stop_reason == "end_turn", empty
    with client(served) as sdk:
        assert sdk.messages.count_tokens(model="fake", messages=[question, {"role": "assistant", "content": ""}]) \
            .input_tokens == sdk.messages.count_tokens(model="fake", messages=[question]).input_tokens
    shaped = ask(served, "Describe Bo", output_config={"format": {"type": "json_schema", "schema": PERSON}})
    assert json.loads(shaped.content[0].text) == {"name": "Bo", "age": 7}


def test_errors_are_anthropics_shape(served):
    def refused(body: dict, status: int = 400, key: str = KEY) -> dict:
        answer = httpx.post(served + "/v1/messages", headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                            json=body, timeout=30)
        assert answer.status_code == status, answer.text
        error = answer.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        return error["error"]

    user = [{"role": "user", "content": "hi"}]
    assert "max_tokens" in refused({"model": "fake", "messages": user})["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    assert "content.0: image blocks are not supported" in refused(
        {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": [image]}]})["message"]
    assert "temperature must be in [0, 1]" in refused({"model": "fake", "max_tokens": 5, "messages": user,
                                                       "temperature": 1.5})["message"]
    hosted = refused({"model": "fake", "max_tokens": 5, "messages": user,
                      "tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]})
    assert "hosted" in hosted["message"] and hosted["type"] == "invalid_request_error"
    for tool in ({"type": "web_search_20250305", "name": "web_search", "max_uses": 5},  # as the SDK sends it
                 {"type": "bash_20250124", "name": "bash"}):
        hosted = refused({"model": "fake", "max_tokens": 5, "messages": user, "tools": [tool]})["message"]
        assert f"'{tool['type']}' is one of Anthropic's hosted tools" in hosted, hosted
    assert "tools.0.input_schema: Field required" in refused(
        {"model": "fake", "max_tokens": 5, "messages": user, "tools": [{"name": "f"}]})["message"]
    assert "tools.0.input_schema" in refused({"model": "fake", "max_tokens": 5, "messages": user,
                                              "tools": [{"name": "f", "input_schema": None}]})["message"]
    assert "given twice" in refused({"model": "fake", "max_tokens": 5, "messages": user,
                                     "tools": [WEATHER, WEATHER]})["message"]
    endless_schema = {"format": {"type": "json_schema", "schema": {"$ref": "#"}}}
    assert refused({"model": "fake", "max_tokens": 5, "messages": user, "output_config": endless_schema})[
        "message"].startswith("output_config.format: no finite JSON value")
    assert "stop_sequences" in refused({"model": "fake", "max_tokens": 5, "messages": user,
                                        "stop_sequences": ["x"] * 100})["message"]
    wrong_role = refused({"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}]})
    assert "messages.0.content.0" in wrong_role["message"]
    assert refused({"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": user}, 404)["type"] == "not_found_error"
    assert refused({"model": "fake", "max_tokens": 5, "messages": user}, 401, key="wrong")["type"] == \
        "authentication_error"
    with client(served) as sdk, pytest.raises(anthropic.BadRequestError) as error:
        sdk.messages.create(model="fake", max_tokens=0, messages=user)
    assert error.value.body["error"]["type"] == "invalid_request_error"
    with client(served, key="wrong") as sdk, pytest.raises(anthropic.AuthenticationError):
        sdk.messages.create(model="fake", max_tokens=5, messages=user)


def post(url: str, body: dict, route: str = "/v1/messages") -> httpx.Response:
    return httpx.post(url + route, headers={"x-api-key": KEY}, timeout=30,
                      json={"model": "fake", **({"max_tokens": 5} if route == "/v1/messages" else {}), **body})


def bad_request(url: str, body: dict, route: str = "/v1/messages") -> str:
    """The message of the 400, in Anthropic's shape, that `body` gets."""
    answer = post(url, body, route)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error == {"type": "error", "error": {"type": "invalid_request_error", "message": error["error"]["message"]}}
    return error["error"]["message"]


def test_a_tool_result_must_answer_an_earlier_call(served):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                              "input": {"city": "Paris", "unit": "c"}}]}

    def result(call_id: str) -> dict:
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "21 degrees"}]}

    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        message = bad_request(served, {"tools": [WEATHER], "messages": [question, call, result("toolu_2")]}, route)
        assert message.startswith("messages.2.content.0: tool_use_id 'toolu_2' matches no tool_use block"), message
        message = bad_request(served, {"tools": [WEATHER], "messages": [result("toolu_1")]}, route)
        assert message.startswith("messages.0.content.0: tool_use_id 'toolu_1'"), message
        assert post(served, {"tools": [WEATHER], "messages": [question, call, result("toolu_1")]}, route) \
            .status_code == 200


def test_top_k_must_not_be_negative(served):
    user = [{"role": "user", "content": "What is the capital of France?"}]
    for top_k in (-1, -7):
        assert bad_request(served, {"messages": user, "top_k": top_k}) == f"top_k must be >= 0, got {top_k}"
    answer = post(served, {"messages": user, "top_k": 0, "temperature": 0, "max_tokens": 200})
    assert answer.status_code == 200 and answer.json()["content"][0]["text"] == REPLIES["capital of France"]

def test_langchain_chat_anthropic(served):
    """LangChain's ChatAnthropic, unchanged: an answer, a stream, and a tool call it binds."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        return "21 degrees"

    model = ChatAnthropic(model="fake", base_url=served, api_key=KEY, temperature=0, max_tokens=200, max_retries=0)
    answer = model.invoke("What is the capital of France?")
    assert answer.content == REPLIES["capital of France"]
    assert "".join(chunk.content if isinstance(chunk.content, str) else "".join(
        part.get("text", "") for part in chunk.content) for chunk in model.stream("What is the capital of France?")) \
        == REPLIES["capital of France"]
    called = model.bind_tools([get_weather], tool_choice="get_weather").invoke("The weather, quickly")
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris", "unit": "c"}


@pytest.mark.e2e
def test_the_tiny_model_answers_as_chat_does(tiny_server):
    messages = [{"role": "user", "content": "Tell me a story."}]
    with anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0, timeout=60) as sdk:
        message = sdk.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, messages=messages,
                                      system="Be kind.")
        with sdk.messages.stream(model="tiny", max_tokens=12, extra_body=GREEDY, messages=messages,
                                 system="Be kind.") as stream:
            streamed = "".join(stream.text_stream)
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as chat:
        twin = chat.chat.completions.create(model="tiny", max_tokens=12, temperature=0,
                                            messages=[{"role": "system", "content": "Be kind."}, *messages])
    assert message.content[0].text == twin.choices[0].message.content == streamed
    assert message.usage.output_tokens == twin.usage.completion_tokens
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[twin.choices[0].finish_reason]


@pytest.mark.e2e
def test_a_client_that_leaves_a_stream_aborts_it(tiny_server):
    aborted = tiny_server.metric('kiln_sequences_finished_total{reason="abort"}', default=0)
    with anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0, timeout=60) as sdk, \
            sdk.messages.stream(model="tiny", max_tokens=100_000, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Tell me a long story."}]) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break
    assert tiny_server.wait_metric('kiln_sequences_finished_total{reason="abort"}', aborted + 1) == aborted + 1
    assert tiny_server.wait_metric("kiln_kv_pages_active", 0) == 0
