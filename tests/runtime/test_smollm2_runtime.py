"""SmolLM2-135M through the whole runtime: the offline LLM API and `kiln generate`."""

from __future__ import annotations

import json

import pytest

from kiln.runtime import LLM, SamplingParams
from tests.conftest import run_kiln
from tests.export.test_smollm2 import REFERENCE_CONTINUATION, REFERENCE_PROMPT

pytestmark = [pytest.mark.e2e, pytest.mark.smollm2]


@pytest.fixture(scope="module")
def llm(smollm2_artifacts):
    with LLM(smollm2_artifacts) as llm:
        yield llm


def test_reference_continuation(llm):
    params = SamplingParams(max_tokens=32, temperature=0)
    [result] = llm.generate([REFERENCE_PROMPT], params, add_special_tokens=False)
    assert result.text == REFERENCE_CONTINUATION
    assert len(result.completions[0].token_ids) == 32
    assert result.completions[0].finish_reason == "length"


def test_the_bundled_model_samples_with_its_model_cards_defaults(llm):
    """Requests that leave temperature and top_p unset get SmolLM2's (0.2, 0.9), not OpenAI's 1.0,
    at which a 135M model rambles."""
    assert llm.service.generation_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert (llm.default_params().temperature, llm.default_params().top_p) == (0.2, 0.9)


def test_batch_of_prompts_matches_solo(llm):
    params = SamplingParams(max_tokens=16, temperature=0)
    prompts = ["The capital of France is", REFERENCE_PROMPT, "def fibonacci(n):", "Water boils at"]
    solo = [llm.generate([p], params)[0].text for p in prompts]
    together = [r.text for r in llm.generate(prompts, params)]
    assert together == solo
    assert llm.service.cache.stats().active == 0


def test_chat_stops_at_end_of_turn(llm):
    from kiln.runtime.chat import render_chat_template

    text = render_chat_template(llm.service.tokenizer_config, [{"role": "user", "content": "What is 2+2?"}])
    assert text.endswith("<|im_start|>assistant\n")
    ids = llm.service.encode(text, add_special_tokens=False)
    [result] = llm.generate([ids], SamplingParams(max_tokens=64, temperature=0))
    assert result.completions[0].finish_reason == "stop"
    assert "4" in result.text


def test_kiln_generate_command(smollm2_artifacts):
    result = run_kiln("generate", "--artifacts", str(smollm2_artifacts), "--prompt", REFERENCE_PROMPT,
                      "--no-special-tokens", "--max-tokens", "32", "--json")
    out = json.loads(result.stdout)
    assert out["completions"][0]["text"] == REFERENCE_CONTINUATION


REPEATED = "The quick brown fox jumps over the lazy dog. Kiln serves compiled models. "
COPY_PROMPT = "Repeat the following text exactly.\n\nText: " + REPEATED * 3 + "\n\nRepeated text: " + REPEATED


def test_speculative_decoding_keeps_greedy_tokens_and_pays_on_copying(llm, smollm2_artifacts):
    from kiln.runtime import Artifacts, SpeculativeConfig

    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [COPY_PROMPT, REFERENCE_PROMPT, "def fibonacci(n):", "Water boils at"]
    plain = [r.completions[0].token_ids for r in llm.generate(prompts, params)]
    draft = Artifacts.in_directory(smollm2_artifacts)
    for spec in (SpeculativeConfig("ngram", 4, disable_by_batch_size=0),
                 SpeculativeConfig("draft_model", 3, draft, disable_by_batch_size=0)):
        with LLM(smollm2_artifacts, speculative=spec) as speculative:
            assert speculative.generate([COPY_PROMPT], params)[0].completions[0].token_ids == plain[0]
            counters = speculative.service.stats().speculation
            assert counters.accepted_tokens > counters.draft_tokens // 2  # copying: most drafts are right
            together = speculative.generate(prompts, params)  # a busy batch of speculating rows
            assert [r.completions[0].token_ids for r in together] == plain
            assert speculative.service.cache.stats().active == 0
