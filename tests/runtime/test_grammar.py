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
    assert compiler.compile(constraint) is compiler.compile(Constraint.of("json", {"type": "object"}, "response_format"))
    for bad in (Constraint.of("regex", "(", "guided_regex"), Constraint.of("grammar", "start: undefined_rule", "guided_grammar"),
                Constraint.of("json", '{"type": "object", "properties": 5}', "guided_json")):
        with pytest.raises(InvalidRequestError) as error:
            compiler.compile(bad)
        assert error.value.param == bad.param
    with pytest.raises(InvalidRequestError):
        Constraint.of("choice", ["a", 3], "guided_choice")


def test_the_mask_allows_only_what_may_follow(compiler, tokenizer):
    matcher = compiler.matcher(Constraint.of("choice", ["yes"], "guided_choice"))
    allowed = np.flatnonzero(matcher.allowed())
    assert allowed.size and all("yes".startswith(tokenizer.decode([int(t)])) for t in allowed)


def test_a_choice_of_fifty_thousand_strings_is_one_lexeme_and_each_sequence_copies_its_matcher(compiler, tokenizer):
    choices = [f"pick {i}" for i in range(50_000)]
    constraint = Constraint.of("choice", choices, "guided_choice")
    first, second = compiler.matcher(constraint), compiler.matcher(constraint)
    assert first._matcher is not second._matcher  # copies of the one compiled, each at its own place
    text, done = generate(compiler, tokenizer, constraint)
    assert done and text in choices
    assert compiler.matcher(Constraint.of("choice", ["a.b", "(c)", "d|e"], "guided_choice")).allowed().any()


def test_a_dead_end_is_an_error_naming_the_field_never_a_stop(compiler, tokenizer):
    """A grammar that lets no token begin is refused at once; one that dead-ends later finishes
    with "error", not "stop" (where a sequence ends, on a matcher driven into its dead end)."""
    from kiln.runtime.finishing import Stopping
    from kiln.runtime.request import Request, Sequence

    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(Constraint.of("json", {"$ref": "#"}, "response_format"))
    assert refused.value.param == "response_format"
    assert refused.value.message.startswith("response_format: no finite JSON value")  # the field named once
    constraint = Constraint.of("regex", "ab", "guided_regex")
    params = SamplingParams(max_tokens=8, constraint=constraint)
    request = Request([5], params, "r", matchers=[compiler.matcher(constraint)])
    seq = Sequence(request, 0)
    request.sequences.append(seq)
    seq.matcher.accept(tokenizer.token_to_id("b"))  # not what the grammar allows: it is now in error
    assert seq.matcher.error is not None and len(seq.matcher.error) <= 300
    stopping = Stopping(tokenizer, eos_token_ids=[EOS_ID], max_seq_len=64)
    stopping.add(request)
    finish = stopping.take(seq, EOS_ID).finish  # all the mask allows a matcher in error
    assert finish.reason == "error" and finish.error.startswith("guided_regex: ")


def test_a_grammar_past_its_compile_budget_is_a_400(fake_model_dir):
    import asyncio

    from kiln.runtime import GenerateService, ServiceConfig
    from kiln.runtime.contract import Artifacts
    from tests.fake_program import FakeProgram

    async def main():
        config = ServiceConfig(Artifacts.in_directory(fake_model_dir), grammar_compile_seconds=0.001)
        service = await GenerateService(config, program_factory=FakeProgram).start()
        try:
            choices = [f"slow {i}" for i in range(50_000)]
            params = SamplingParams(constraint=Constraint.of("choice", choices, "guided_choice"))
            with pytest.raises(InvalidRequestError) as error:
                await service.compile_grammars([params])
            assert error.value.param == "guided_choice" and "to compile" in error.value.message
        finally:
            await service.stop()

    asyncio.run(main())


def test_a_constraint_after_a_marker_is_free_until_the_marker_then_binds(compiler, tokenizer):
    """A reasoning model's `</think>`, several tokens in the tiny vocabulary (as in many), split
    across tokens any way: every token is allowed until its text is complete, then only the JSON."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    plain = Constraint.of("json", schema, "response_format")
    constraint = plain.after("</think>")
    assert constraint.grammar_key == plain and compiler.compile(constraint) is compiler.compile(plain)
    marker = tokenizer.encode("</think>", add_special_tokens=False).ids
    assert len(marker) > 1
    for thinking in (tokenizer.encode("Let me see.", add_special_tokens=False).ids + marker,
                     [tokenizer.token_to_id(c) for c in "ok</think>"]):  # one character a token
        matcher = compiler.matcher(constraint)
        for token in thinking:
            assert matcher.allowed().all() and not matcher.finished and matcher.error is None
            logits = np.zeros(VOCAB, np.float32)
            assert matcher.mask_logits(logits) is logits
            matcher.accept(token)
        allowed = np.flatnonzero(matcher.allowed())
        assert 0 < allowed.size < VOCAB and all(tokenizer.decode([int(t)]).startswith("{") for t in allowed)
        for token in tokenizer.encode('{"ok":true}', add_special_tokens=False).ids:
            matcher.accept(token)
        assert matcher.finished and matcher.error is None
