"""vLLM's chat template fields through real HTTP over the fake program: continue_final_message
(the last assistant message left open, the model going on with it) and add_generation_prompt,
as /tokenize and /v1/chat/completions render them, and the 400s for asking for both or for
continuing a message that is not the assistant's."""

from __future__ import annotations

import httpx
import pytest

from tests.fake_program import expected_greedy

QUESTION = {"role": "user", "content": "What is two and two?"}
PREFILLED = {"role": "assistant", "content": "It is"}
RENDERED = "<|im_start|>user\nWhat is two and two?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def client(start_fake_server):
    port, service = start_fake_server()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        client.service = service
        yield client


def tokenized(client, **body) -> str:
    answer = client.post("/tokenize", json=body)
    assert answer.status_code == 200, answer.text
    return client.service.decode(answer.json()["tokens"], skip_special_tokens=False)


def test_the_final_message_is_continued_not_closed(client):
    messages = [QUESTION, PREFILLED]
    for fields in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        assert tokenized(client, messages=messages, **fields) == RENDERED + "It is"
    prompt = client.service.encode(RENDERED + "It is", add_special_tokens=False)
    body = client.post("/v1/chat/completions", json={
        "messages": messages, "continue_final_message": True, "max_tokens": 5, "temperature": 0}).json()
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["message"]["content"] == client.service.decode(expected_greedy(prompt, 5))
    # Without it the assistant's message is closed and a new one begins.
    assert tokenized(client, messages=messages) == RENDERED + "It is<|im_end|>\n<|im_start|>assistant\n"


def test_add_generation_prompt_false_leaves_the_assistant_header_out(client):
    bare = RENDERED.removesuffix("<|im_start|>assistant\n")
    assert tokenized(client, messages=[QUESTION], add_generation_prompt=False) == bare
    body = client.post("/v1/chat/completions", json={"messages": [QUESTION], "add_generation_prompt": False,
                                                     "max_tokens": 1}).json()
    assert body["usage"]["prompt_tokens"] == len(client.service.encode(bare, add_special_tokens=False))


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("fields, messages, says", [
    ({"continue_final_message": True, "add_generation_prompt": True}, [QUESTION, PREFILLED], "cannot both be true"),
    ({"continue_final_message": True}, [QUESTION], "must be the assistant's, not the 'user''s"),
    ({"continue_final_message": True, "add_generation_prompt": False}, [QUESTION, {"role": "assistant", "content": ""}],
     "needs text to continue"),
])
def test_what_cannot_be_continued_is_a_400(client, route, fields, messages, says):
    answer = client.post(route, json={"messages": messages, "max_tokens": 2, **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] in ("continue_final_message", "messages")
