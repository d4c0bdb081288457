"""Fill-in-the-middle through /v1/completions' `suffix` (the openai SDK) and llama.cpp's /infill,
over real HTTP: a scripted code model (a tokenizer with Qwen2.5-Coder's FIM tokens) answers only
the exact prefix-suffix-middle prompt (or the repository-level one), and its fill ends at its own
end-of-fill token; models without FIM tokens, token-id prompts and echo are refused naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from tokenizers import AddedToken

from kiln.server.fill_in_middle import FillInMiddle
from tests.fake_program import write_fake_artifacts
from tests.scripted_program import ScriptedProgram
from tests.tiny_model import make_tiny_tokenizer

FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|file_sep|>"]
PREFIX, SUFFIX = "def add(a, b):\n", "\n    return total"
FILL = "    total = a + b"
FIM = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
# The whole prompt as the model must read it (BOS, the tiny tokenizer's lead, first).
REPLIES = {
    "<s>" + FIM: FILL + "<|fim_pad|>def more():",
    "<s><|file_sep|>util.py\nSCALE = 3\n<|file_sep|>filename\n" + FIM: "    total = (a + b) * SCALE<|fim_pad|>",
    "<s><|fim_prefix|>lines = [<|fim_suffix|>]<|fim_middle|>": "'one',\n" + "'more', " * 100,
}


def code_tokenizer():
    tokenizer = make_tiny_tokenizer(384 - len(FIM_TOKENS))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in FIM_TOKENS])
    return tokenizer


@pytest.fixture(scope="module")
def code_model(start_fake_server, tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("fim-model")
    write_fake_artifacts(directory, code_tokenizer().to_str(), {"bos_token": "<s>", "eos_token": "</s>"},
                         max_seq_len=512, pages=160)
    port, _ = start_fake_server(model_dir=directory,
                                program_factory=lambda *args: ScriptedProgram(*args, replies=REPLIES))
    return f"http://127.0.0.1:{port}"


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_tokens_are_found_by_their_spelling():
    tokenizer = code_tokenizer()
    fim = FillInMiddle.of(tokenizer)
    ids = {token: tokenizer.token_to_id(token) for token in FIM_TOKENS}
    assert (fim.prefix, fim.suffix, fim.middle) == (ids["<|fim_prefix|>"], ids["<|fim_suffix|>"], ids["<|fim_middle|>"])
    assert fim.ends == (ids["<|fim_pad|>"], ids["<|file_sep|>"])
    assert fim.prompt([0], [7, 8], [9]) == [0, fim.prefix, 7, 8, fim.suffix, 9, fim.middle]
    assert FillInMiddle.of(make_tiny_tokenizer()) is None


def test_the_middle_is_filled_and_ends_at_its_own_token(code_model):
    with sdk(code_model) as client:
        completion = client.completions.create(model="fake", prompt=PREFIX, suffix=SUFFIX, max_tokens=60,
                                               temperature=0)
        streamed = list(client.completions.create(model="fake", prompt=PREFIX, suffix=SUFFIX, max_tokens=60,
                                                  temperature=0, stream=True))
    [choice] = completion.choices
    assert choice.text == FILL and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == code_tokenizer().token_to_id("<|fim_pad|>")
    prefix, suffix = (len(code_tokenizer().encode(text, add_special_tokens=False).ids) for text in (PREFIX, SUFFIX))
    assert completion.usage.prompt_tokens == 1 + 1 + prefix + 1 + suffix + 1
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == FILL
    # Without the suffix the same prefix is a plain completion, which the scripted model does not fill.
    with sdk(code_model) as client:
        plain = client.completions.create(model="fake", prompt=PREFIX, max_tokens=60, temperature=0)
    assert plain.choices[0].text != FILL and plain.usage.prompt_tokens == 1 + prefix


@pytest.mark.parametrize("body,param", [
    ({"prompt": [5, 6, 7], "suffix": "x"}, "suffix"),
    ({"prompt": "def f():", "suffix": "x", "echo": True}, "echo"),
])
def test_what_a_fill_cannot_take_is_a_400(code_model, body, param):
    response = httpx.post(code_model + "/v1/completions", json={"model": "fake", "max_tokens": 4, **body}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_model_without_fim_tokens_refuses_a_suffix(fake_server):
    response = httpx.post(f"http://127.0.0.1:{fake_server}/v1/completions",
                          json={"prompt": "def f():", "suffix": "\n", "max_tokens": 4}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in response.json()["error"]["message"]


def infill(url: str, **fields) -> httpx.Response:
    return httpx.post(url + "/infill", json={"temperature": 0, **fields}, timeout=60)


def test_llama_cpp_infill(code_model):
    """llama.cpp's /infill as llama.vscode sends it: the same fill, whole and streamed, with
    llama.cpp's fields; other files as repository-level context; a prefix cut to fit."""
    whole = infill(code_model, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=60).json()
    assert whole["content"] == FILL and whole["stop"] is True and whole["stop_type"] == "eos"
    prefix, suffix = (len(code_tokenizer().encode(text, add_special_tokens=False).ids) for text in (PREFIX, SUFFIX))
    assert whole["tokens_evaluated"] == 1 + 1 + prefix + 1 + suffix + 1 and whole["truncated"] is False
    assert whole["tokens_predicted"] == whole["timings"]["predicted_n"] > 0
    # The text typed at the cursor goes after the prefix: the same prompt, split differently.
    split = infill(code_model, input_prefix=PREFIX[:4], prompt=PREFIX[4:], input_suffix=SUFFIX, n_predict=60)
    assert split.json()["content"] == FILL
    chunks = [json.loads(line.removeprefix("data: ")) for line in infill(
        code_model, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=60, stream=True).text.splitlines() if line]
    assert "".join(chunk["content"] for chunk in chunks) == FILL
    assert [chunk["stop"] for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["stop_type"] == "eos" and chunks[-1]["tokens_predicted"] == whole["tokens_predicted"]
    repository = infill(code_model, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=60,
                        input_extra=[{"filename": "util.py", "text": "SCALE = 3\n"}]).json()
    assert repository["content"] == "    total = (a + b) * SCALE"
    cut = infill(code_model, input_prefix="x = 1\n" * 400, input_suffix=SUFFIX, n_predict=100).json()
    assert cut["truncated"] is True and cut["tokens_evaluated"] <= 512 - 100


def test_infill_stops_at_its_time_limit_once_it_has_a_newline(code_model):
    body = {"input_prefix": "lines = [", "input_suffix": "]", "n_predict": 200}
    full = infill(code_model, **body).json()
    assert full["stop_type"] == "limit" and full["tokens_predicted"] == 200
    quick = infill(code_model, **body, t_max_predict_ms=1).json()
    assert quick["stop_type"] == "limit" and quick["content"].startswith("'one',\n")
    assert quick["tokens_predicted"] < 200


def test_infill_needs_a_fim_model(fake_server):
    response = httpx.post(f"http://127.0.0.1:{fake_server}/infill", json={"input_prefix": "def f():"}, timeout=30)
    assert response.status_code == 400 and "fill-in-the-middle" in response.json()["error"]["message"]
