"""`--reasoning-parser` through real HTTP on 127.0.0.1 and the openai SDK: a scripted program
writes a reasoning model's replies (`<think>…</think>` then the answer), and the server splits
them into reasoning_content and content, whole and streamed, reads tool calls from the answer
only, and starts a JSON schema's grammar after the thinking; the Responses API returns the
thinking as a `reasoning` item. The tags are one token each (Qwen3's and DeepSeek's vocabularies)
or several (the tiny tokenizer's own)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from tokenizers import AddedToken

from tests.fake_program import write_fake_artifacts
from tests.scripted_program import ScriptedProgram
from tests.tiny_model import make_tiny_tokenizer

# ChatML that shows tools by name, and writes an empty, closed think block for enable_thinking
# false (as Qwen3's template does); DeepSeek-R1's opens the block itself.
CHAT = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
)
QWEN3_TEMPLATE = CHAT + (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
DEEPSEEK_R1_TEMPLATE = CHAT + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'

# What the scripted model answers when the prompt holds the trigger (the user's words).
REPLIES = {
    "capital of France": "<think>\nThe capital of France is Paris.\n</think>\n\nParis.",
    "Think at length": "<think>\nOne, two, three, four, five, six, seven, eight, nine, ten.",
    "No thinking please": "Plain answer.",
    "weather in Paris": f"<think>I need the weather tool.</think>\n\n<tool_call>\n{WEATHER_CALL}\n</tool_call>",
    "weather, required": "<think>Call it.</think><tool_call>\n"
                         '{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>',
    "Just talk": f"<think>A call would be <tool_call>{WEATHER_CALL}</tool_call>, but no.</think>No call needed.",
    "Describe Ada": '<think>Ada Lovelace {born 1815}, not JSON yet.</think>{"name":"Ada","age":36} and more text',
    "Describe Bo": '{"name":"Bo","age":7}',
    "six times seven": "Six sevens: 42.</think>\n\n42",
}


def model_dir(directory, template: str, tags_are_tokens: bool):
    """Fake artifacts whose tokenizer has <think> and </think> as tokens of their own (not special,
    as in Qwen3's and DeepSeek's), or leaves them to the byte-level merges (several tokens each)."""
    tokenizer = make_tiny_tokenizer(382 if tags_are_tokens else 384)
    if tags_are_tokens:
        tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    write_fake_artifacts(directory, tokenizer.to_str(), config, max_seq_len=512, pages=160)
    return directory


def server(start_fake_server, tmp_path_factory, template, parser, tags_are_tokens=True):
    directory = model_dir(tmp_path_factory.mktemp("reasoning-model"), template, tags_are_tokens)
    port, service = start_fake_server(
        model_dir=directory, reasoning_parser=parser, tool_call_parser="hermes",
        program_factory=lambda *args: ScriptedProgram(*args, replies=REPLIES))
    return f"http://127.0.0.1:{port}", service


@pytest.fixture(scope="module")
def qwen3(start_fake_server, tmp_path_factory):
    return server(start_fake_server, tmp_path_factory, QWEN3_TEMPLATE, "qwen3")


@pytest.fixture(scope="module")
def deepseek_r1(start_fake_server, tmp_path_factory):
    return server(start_fake_server, tmp_path_factory, DEEPSEEK_R1_TEMPLATE, "deepseek_r1")


@pytest.fixture(scope="module")
def split_tags(start_fake_server, tmp_path_factory):
    return server(start_fake_server, tmp_path_factory, QWEN3_TEMPLATE, "qwen3", tags_are_tokens=False)


@pytest.fixture(scope="module")
def plain(start_fake_server, tmp_path_factory):
    """The same model with no reasoning parser: replies are content, tags and all."""
    directory = model_dir(tmp_path_factory.mktemp("plain-model"), QWEN3_TEMPLATE, True)
    port, _ = start_fake_server(model_dir=directory,
                                program_factory=lambda *args: ScriptedProgram(*args, replies=REPLIES))
    return f"http://127.0.0.1:{port}"


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(url: str, question: str, **fields):
    with sdk(url) as client:
        return client.chat.completions.create(model="fake", messages=[{"role": "user", "content": question}],
                                              temperature=0, max_tokens=fields.pop("max_tokens", 120), **fields)


def stream(url: str, question: str, **fields) -> list:
    with sdk(url) as client:
        return list(client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": question}], temperature=0,
            max_tokens=fields.pop("max_tokens", 120), stream=True, **fields))


def joined(chunks: list, field: str) -> str | None:
    pieces = [getattr(c.choices[0].delta, field, None) for c in chunks if c.choices]
    return "".join(p for p in pieces if p) or None


def test_reasoning_content_beside_the_answer(qwen3):
    url, _ = qwen3
    [choice] = ask(url, "What is the capital of France?").choices
    assert choice.message.reasoning_content == "\nThe capital of France is Paris.\n"
    assert choice.message.content == "\n\nParis." and choice.finish_reason == "stop"
    raw = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "capital of France"}], "temperature": 0}).json()
    message = raw["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nThe capital of France is Paris.\n"


def test_streamed_reasoning_never_shows_a_tag_nor_an_empty_delta(qwen3):
    url, _ = qwen3
    chunks = stream(url, "What is the capital of France?", stream_options={"include_usage": True})
    assert joined(chunks, "reasoning_content") == "\nThe capital of France is Paris.\n"
    assert joined(chunks, "reasoning") == joined(chunks, "reasoning_content")
    assert joined(chunks, "content") == "\n\nParis."
    deltas = [c.choices[0] for c in chunks if c.choices][1:]  # after the role's
    for choice in deltas:
        fields = {k: v for k, v in choice.delta.model_dump(exclude_none=True).items() if v not in ("", [])}
        assert fields or choice.finish_reason, choice  # the end tag alone sent nothing
        assert not any("think>" in str(v) for v in fields.values()), fields
    kinds = ["reasoning" if getattr(c.delta, "reasoning_content", None) else "content" for c in deltas
             if getattr(c.delta, "reasoning_content", None) or c.delta.content]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")  # all the reasoning, then the answer
    # A chunk per token but the two tags', each a token alone: they sent nothing, and nothing else was held.
    assert len(deltas) == chunks[-1].usage.completion_tokens - 2


def test_a_reply_cut_short_is_all_reasoning(qwen3):
    url, _ = qwen3
    [choice] = ask(url, "Think at length", max_tokens=8).choices
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.reasoning_content.startswith("\nOne,") and "<think>" not in choice.message.reasoning_content
    assert joined(stream(url, "Think at length", max_tokens=8), "reasoning_content") == \
        choice.message.reasoning_content


def test_include_reasoning_false_leaves_it_out(qwen3):
    url, _ = qwen3
    [choice] = ask(url, "capital of France", extra_body={"include_reasoning": False}).choices
    assert choice.message.content == "\n\nParis." and choice.message.reasoning_content is None
    chunks = stream(url, "capital of France", extra_body={"include_reasoning": False})
    assert joined(chunks, "reasoning_content") is None and joined(chunks, "content") == "\n\nParis."


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_all_content(qwen3):
    url, service = qwen3
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    messages = [{"role": "user", "content": "No thinking please"}]
    ids = httpx.post(url + "/tokenize", json={"messages": messages, **off}).json()["tokens"]
    assert service.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    [choice] = ask(url, "No thinking please", extra_body=off).choices
    assert choice.message.content == "Plain answer." and choice.message.reasoning_content is None
    assert joined(stream(url, "No thinking please", extra_body=off), "content") == "Plain answer."
    # Without the flag the reply begins in the reasoning, which it never leaves.
    assert ask(url, "No thinking please").choices[0].message.reasoning_content == "Plain answer."


def test_a_tool_call_after_the_reasoning(qwen3):
    url, _ = qwen3
    [choice] = ask(url, "What is the weather in Paris?", tools=[WEATHER]).choices
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "I need the weather tool."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    assert choice.message.content is None
    chunks = stream(url, "What is the weather in Paris?", tools=[WEATHER])
    assert joined(chunks, "reasoning_content") == "I need the weather tool." and joined(chunks, "content") == "\n\n"
    [call] = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert call.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_written_in_the_reasoning_is_not_a_call(qwen3):
    url, _ = qwen3
    [choice] = ask(url, "Just talk", tools=[WEATHER]).choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "No call needed." and "<tool_call>" in choice.message.reasoning_content


def test_tool_choice_required_is_forced_after_the_reasoning(qwen3):
    url, _ = qwen3
    [choice] = ask(url, "The weather, required", tools=[WEATHER], tool_choice="required").choices
    assert choice.message.reasoning_content == "Call it."
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}


@pytest.mark.parametrize("served", ["qwen3", "split_tags"])
def test_a_json_schema_binds_the_answer_after_free_reasoning(served, request):
    url, _ = request.getfixturevalue(served)
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    [choice] = ask(url, "Describe Ada", response_format=schema).choices
    # The reasoning is not JSON (the grammar did not bind it); the answer is, and ends where the schema does.
    assert choice.message.reasoning_content == "Ada Lovelace {born 1815}, not JSON yet."
    assert json.loads(choice.message.content) == {"name": "Ada", "age": 36} and choice.finish_reason == "stop"
    chunks = stream(url, "Describe Ada", response_format=schema)
    assert json.loads(joined(chunks, "content")) == {"name": "Ada", "age": 36}
    # Unconstrained, the same model runs on past the JSON.
    assert ask(url, "Describe Ada").choices[0].message.content == '{"name":"Ada","age":36} and more text'


def test_with_thinking_off_the_schema_binds_from_the_first_token(qwen3):
    url, _ = qwen3
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    [choice] = ask(url, "Describe Bo", response_format=schema,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices
    assert json.loads(choice.message.content) == {"name": "Bo", "age": 7} and choice.message.reasoning_content is None


def test_deepseek_r1_thinks_from_the_first_token(deepseek_r1):
    url, _ = deepseek_r1
    [choice] = ask(url, "What is six times seven?").choices
    assert choice.message.reasoning_content == "Six sevens: 42." and choice.message.content == "\n\n42"
    chunks = stream(url, "What is six times seven?")
    assert (joined(chunks, "reasoning_content"), joined(chunks, "content")) == ("Six sevens: 42.", "\n\n42")
    # It does not read enable_thinking (its template has no such switch): still reasoning first.
    off = ask(url, "What is six times seven?", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.reasoning_content == "Six sevens: 42."


def test_without_a_parser_and_on_completions_the_text_is_raw(plain, qwen3):
    message = ask(plain, "capital of France").choices[0].message
    assert message.content == REPLIES["capital of France"] and getattr(message, "reasoning_content", None) is None
    url, _ = qwen3
    with sdk(url) as client:
        completion = client.completions.create(model="fake", prompt="capital of France", max_tokens=40,
                                               temperature=0)
    assert completion.choices[0].text == REPLIES["capital of France"]


def test_the_responses_api_returns_a_reasoning_item_before_the_message(qwen3):
    url, service = qwen3
    with sdk(url) as client:
        response = client.responses.create(model="fake", input="What is the capital of France?", temperature=0)
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
        assert [part.text for part in reasoning.content] == ["\nThe capital of France is Paris.\n"]
        assert message.type == "message" and response.output_text == "\n\nParis."
        ids = service.encode(REPLIES["capital of France"], add_special_tokens=False)
        think_end = service.encode("</think>", add_special_tokens=False)[0]
        assert response.usage.output_tokens_details.reasoning_tokens == ids.index(think_end) + 1

        events = list(client.responses.create(model="fake", input="What is the capital of France?", temperature=0,
                                              stream=True))
        kinds = [event.type for event in events]
        item_events = ["response.output_item.added", "response.content_part.added"]
        closing = ["response.content_part.done", "response.output_item.done"]
        reasoning_deltas = kinds.count("response.reasoning_text.delta")
        text_deltas = kinds.count("response.output_text.delta")
        assert kinds == ["response.created", "response.in_progress", *item_events,
                         *["response.reasoning_text.delta"] * reasoning_deltas, "response.reasoning_text.done",
                         *closing, *item_events, *["response.output_text.delta"] * text_deltas,
                         "response.output_text.done", *closing, "response.completed"]
        assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
        final = events[-1].response
        assert [item.type for item in final.output] == ["reasoning", "message"]
        assert final.output[0].content[0].text == reasoning.content[0].text and final.output_text == "\n\nParis."
        assert final.usage.output_tokens_details.reasoning_tokens == ids.index(think_end) + 1

        # The reasoning item sent back with the conversation, as the SDK's clients do, is accepted.
        again = client.responses.create(model="fake", temperature=0, input=[
            {"role": "user", "content": "Think at length"}, response.output[0].model_dump(exclude_none=True),
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "What is the capital of France?"}])
        assert again.output_text == "\n\nParis."
