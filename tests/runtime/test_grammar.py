"""Structured output's pieces without a device: constraints, the compiler's cache, a matcher's
mask, and the sampler choosing only what the grammar allows."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.grammar import Constraint, GrammarCompiler
from kiln.runtime.sampling import Sampler, SamplingParams
from tests.tiny_model import EOS_ID, make_tiny_tokenizer

VOCAB = 384


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.to_str(), VOCAB, [EOS_ID])


class Row:
    """What Sampler.sample_rows reads of a sequence."""

    def __init__(self, params, matcher):
        self.params, self.matcher = params, matcher
        self.rng = np.random.default_rng(0)
        self.prompt_ids, self.output_ids = [], []


def generate(compiler, tokenizer, constraint, temperature=1.0, steps=80, seed=0) -> tuple[str, bool]:
    """Random logits, constrained: (the text, whether the grammar completed)."""
    matcher = compiler.matcher(constraint)
    row, sampler, rng = Row(SamplingParams(temperature=temperature), matcher), Sampler([EOS_ID]), np.random.default_rng(seed)
    for _ in range(steps):
        [sample] = sampler.sample_rows([rng.standard_normal(VOCAB).astype(np.float32) * 3], [row])
        if sample.token_id == EOS_ID or matcher.finished:
            if sample.token_id != EOS_ID:
                row.output_ids.append(sample.token_id)
            return tokenizer.decode(row.output_ids), True
        row.output_ids.append(sample.token_id)
    return tokenizer.decode(row.output_ids), False


@pytest.mark.parametrize("seed", range(5))
def test_random_logits_still_give_valid_json(compiler, tokenizer, seed):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    text, done = generate(compiler, tokenizer, Constraint.of("json", schema, "guided_json"), seed=seed)
    assert done, text
    value = json.loads(text)
    assert isinstance(value["n"], int) and isinstance(value["ok"], bool)


def test_regex_choice_and_grammar(compiler, tokenizer):
    text, done = generate(compiler, tokenizer, Constraint.of("regex", "[a-c]{3}-[0-9]{2}", "guided_regex"))
    assert done and re.fullmatch("[a-c]{3}-[0-9]{2}", text)
    text, done = generate(compiler, tokenizer, Constraint.of("choice", ["red", "green"], "guided_choice"))
    assert done and text in ("red", "green")
    lark = 'start: "[" item ("," item)* "]"\nitem: /[xy]/'
    text, done = generate(compiler, tokenizer, Constraint.of("grammar", lark, "guided_grammar"), temperature=0.5)
    assert not done or re.fullmatch(r"\[[xy](,[xy])*\]", text)


def test_compiled_grammars_are_cached_and_bad_ones_are_400s(compiler):
    constraint = Constraint.of("json", {"type": "object"}, "response_format")
    assert compiler.grammar(constraint) is compiler.grammar(Constraint.of("json", {"type": "object"}, "response_format"))
    for bad in (Constraint.of("regex", "(", "guided_regex"), Constraint.of("grammar", "start: undefined_rule", "guided_grammar"),
                Constraint.of("json", '{"type": "object", "properties": 5}', "guided_json")):
        with pytest.raises(InvalidRequestError) as error:
            compiler.grammar(bad)
        assert error.value.param == bad.param
    with pytest.raises(InvalidRequestError):
        Constraint.of("choice", ["a", 3], "guided_choice")


def test_the_mask_allows_only_what_may_follow(compiler, tokenizer):
    matcher = compiler.matcher(Constraint.of("choice", ["yes"], "guided_choice"))
    allowed = np.flatnonzero(matcher.allowed())
    assert allowed.size and all("yes".startswith(tokenizer.decode([int(t)])) for t in allowed)
