"""runtime/sampling.py: parameters, penalties, greedy and random draws, logprobs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pytest

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling import (
    SampleResult,
    Sampler,
    SamplingParams,
    apply_penalties,
    compute_logprobs,
    make_generator,
    model_generation_defaults,
)

V = 1000


def random_logits(seed: int = 0, size: int = V, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(size) * scale).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def draws(logits, params, seed=0, count=200, sampler=None, **kw) -> list[int]:
    sampler = sampler or Sampler()
    rng = make_generator(seed)
    return [sampler.sample(logits, params, rng, **kw).token_id for _ in range(count)]


# --- SamplingParams -----------------------------------------------------------------


def test_defaults_validate():
    p = SamplingParams().validate(V)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.n) == (16, 1.0, -1, 1.0, 1)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and not p.greedy


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams.from_kwargs(stop="User:", temperature=None).stop == ["User:"]
    assert SamplingParams.from_kwargs(temperature=None).temperature == 1.0


def test_from_kwargs_rejects_unknown_names():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_kwargs(best_of=2)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(seed=1.5), "seed"),
        (dict(n=0), "n"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[V]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
        (dict(stop=[f"s{i}" for i in range(65)]), "stop"),
        (dict(stop=["x" * 513]), "stop"),
        (dict(stop_token_ids=list(range(257))), "stop_token_ids"),
    ],
)
def test_validate_rejects_nonsense_naming_the_field(kwargs, name):
    with pytest.raises(InvalidRequestError, match=name) as error:
        SamplingParams(**kwargs).validate(V)
    assert error.value.param == name


def test_validate_accepts_edge_values():
    SamplingParams(
        temperature=0, top_k=0, top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
        seed=-7, logprobs=20, min_tokens=16, stop_token_ids=[0, V - 1],
    ).validate(V)
    SamplingParams(top_k=V * 10, logprobs=0).validate(V)


# --- greedy --------------------------------------------------------------------------


def test_greedy_is_argmax():
    sampler = Sampler()
    for seed in range(5):
        x = random_logits(seed)
        r = sampler.sample(x, SamplingParams(temperature=0), make_generator(seed))
        assert r == SampleResult(int(np.argmax(x)))


def test_greedy_ties_go_to_the_lowest_id():
    x = np.zeros(8, np.float32)
    x[[5, 2, 7]] = 4.0
    assert Sampler().sample(x, SamplingParams(temperature=0), make_generator(0)).token_id == 2


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 2.0, 50.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature):
    for seed in range(5):
        x = random_logits(seed, scale=0.5)
        assert set(draws(x, SamplingParams(top_k=1, temperature=temperature), seed, 20)) == {int(np.argmax(x))}


def test_greedy_does_not_consume_randomness():
    rng = make_generator(3)
    Sampler().sample(random_logits(), SamplingParams(temperature=0), rng)
    assert rng.random() == make_generator(3).random()


# --- random draws --------------------------------------------------------------------


def test_seeded_sampling_repeats_exactly_and_seeds_differ():
    x = random_logits(1, scale=0.5)  # flat enough that draws vary
    p = SamplingParams(temperature=1.0, top_p=0.95)
    a, b, c = draws(x, p, seed=123), draws(x, p, seed=123), draws(x, p, seed=124)
    assert a == b
    assert a != c
    assert len(set(a)) > 20


def test_generators_for_the_n_sequences_of_one_request_differ():
    x = random_logits(1, scale=0.5)
    a = [Sampler().sample(x, SamplingParams(), g).token_id for g in [make_generator(9, 0)] * 50]
    b = [Sampler().sample(x, SamplingParams(), g).token_id for g in [make_generator(9, 1)] * 50]
    assert a != b
    assert make_generator(9).random() == np.random.default_rng(9).random()
    assert make_generator(-1).random() == make_generator(-1).random()


def test_temperature_distribution_on_a_small_vocab():
    x = np.array([0.0, 1.0, 2.0, 3.0], np.float32)
    for temperature in (0.5, 1.0, 2.0):
        expected = np.exp(log_softmax(x / temperature))
        got = np.bincount(draws(x, SamplingParams(temperature=temperature), seed=7, count=20000), minlength=4)
        np.testing.assert_allclose(got / got.sum(), expected, atol=0.015)


def test_distribution_over_a_large_vocab_uses_every_block():
    # Large enough for the two-level inverse CDF; weights spread over the whole vocabulary.
    x = np.full(3000, -np.inf, np.float32)
    x[[5, 700, 1500, 2999]] = np.log([0.1, 0.2, 0.3, 0.4])
    got = np.bincount(draws(x, SamplingParams(), seed=1, count=20000), minlength=3000)
    assert got.sum() == got[[5, 700, 1500, 2999]].sum()
    np.testing.assert_allclose(got[[5, 700, 1500, 2999]] / 20000, [0.1, 0.2, 0.3, 0.4], atol=0.015)


def test_top_k_keeps_only_the_k_best():
    x = random_logits(2, scale=0.3)
    best = set(np.argsort(-x)[:3].tolist())
    assert set(draws(x, SamplingParams(top_k=3), count=500)) == best


def test_tiny_top_p_always_picks_the_top_token():
    for seed in range(3):
        x = random_logits(seed, size=50_000, scale=0.5)
        assert set(draws(x, SamplingParams(top_p=1e-6, temperature=2.0), seed, 50)) == {int(np.argmax(x))}


def test_top_p_keeps_the_smallest_set_reaching_p():
    x = np.log(np.array([0.15, 0.5, 0.05, 0.3], np.float32))
    assert set(draws(x, SamplingParams(top_p=0.75), count=500)) == {1, 3}  # 0.5 + 0.3 >= 0.75
    assert set(draws(x, SamplingParams(top_p=0.85), count=500)) == {0, 1, 3}
    assert set(draws(x, SamplingParams(top_p=0.5), count=100)) == {1}


@pytest.mark.parametrize("peak", [0.0, 6.0])
def test_top_p_on_a_large_vocab(peak):
    # Flat: the nucleus is wider than the partial-sort shortcut, so the full sort runs;
    # peaked: the nucleus is inside the best 256 weights, so only those are sorted.
    x = random_logits(4, size=20_000, scale=0.1)
    x[:200] += peak
    order = np.argsort(-x, kind="stable")
    p = np.exp(log_softmax(x))[order]
    nucleus = set(order[: int(np.searchsorted(np.cumsum(p), 0.5)) + 1].tolist())
    assert 50 < len(nucleus) < (256 if peak else 20_000)
    got = set(draws(x, SamplingParams(top_p=0.5), count=300))
    assert got <= nucleus and len(got) > 40


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    assert set(draws(x, SamplingParams(min_p=0.2), count=1000)) == {0, 1, 2}  # 0.05 < 0.2 * 0.5
    assert set(draws(x, SamplingParams(min_p=0.7), count=100)) == {0}  # 0.3 < 0.35


def test_filters_combine():
    x = random_logits(5, scale=0.3)
    got = set(draws(x, SamplingParams(top_k=10, top_p=0.999, min_p=0.01, temperature=0.7), count=500))
    assert got <= set(np.argsort(-x)[:10].tolist())


# --- penalties and min_tokens --------------------------------------------------------


def test_penalties_change_the_right_logits():
    x = np.array([2.0, -1.0, 0.5, 3.0, 0.0], np.float32)
    before = x.copy()
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.1)
    y = apply_penalties(x, p, output_ids=[1, 1, 2], prompt_ids=[0])
    # repetition (prompt + output): 2 -> 1, -1 -> -2, 0.5 -> 0.25; then output counts:
    # token 1 (twice): -2 - 2*0.5 - 0.1; token 2 (once): 0.25 - 0.5 - 0.1.
    np.testing.assert_allclose(y, [1.0, -3.1, -0.35, 3.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(x, before)
    assert apply_penalties(x, SamplingParams(), [1, 2], [0]) is x


def test_presence_and_frequency_ignore_the_prompt():
    x = np.zeros(4, np.float32)
    y = apply_penalties(x, SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), [3], [0, 1, 2])
    np.testing.assert_array_equal(y, [0, 0, 0, -2])


def test_repetition_penalty_steers_greedy():
    x = np.array([1.0, 1.2, 0.0], np.float32)
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert Sampler().sample(x, p, make_generator(0), output_ids=[1]).token_id == 0
    assert Sampler().sample(x, p, make_generator(0), output_ids=[0]).token_id == 1


def test_min_tokens_holds_back_eos_and_stop_ids():
    x = np.array([0.0, 5.0, 4.0, 3.0], np.float32)  # EOS (1) is the best token, then stop id 2
    sampler = Sampler(eos_token_ids=[1])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    pick = lambda out, params=p: sampler.sample(x, params, make_generator(0), output_ids=out).token_id
    assert pick([]) == 3 and pick([3]) == 3
    assert pick([3, 3]) == 1
    assert pick([], SamplingParams(temperature=0)) == 1
    assert set(draws(x, SamplingParams(min_tokens=5, stop_token_ids=[2]), count=200, sampler=sampler)) <= {0, 3}


# --- logprobs ------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits():
    x = random_logits(6)
    expected = log_softmax(x)
    p = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.3, logprobs=5)
    r = Sampler().sample(x, p, make_generator(0), output_ids=[int(np.argmax(x))])
    assert r.logprob == pytest.approx(expected[r.token_id], abs=1e-5)
    assert list(r.top_logprobs) == np.argsort(-x)[:5].tolist()
    values = list(r.top_logprobs.values())
    assert values == sorted(values, reverse=True)
    np.testing.assert_allclose(values, expected[list(r.top_logprobs)], atol=1e-5)


def test_logprobs_zero_gives_only_the_chosen_token():
    x = random_logits(7)
    r = Sampler().sample(x, SamplingParams(temperature=0, logprobs=0), make_generator(0))
    assert r.top_logprobs == {} and r.logprob == pytest.approx(log_softmax(x).max(), abs=1e-5)
    r = Sampler().sample(x, SamplingParams(temperature=0), make_generator(0))
    assert r.logprob is None and r.top_logprobs is None


def test_compute_logprobs_ties_and_small_vocab():
    x = np.array([1.0, 3.0, 3.0, 0.0], np.float32)
    logprob, top = compute_logprobs(x, 0, 20)
    assert list(top) == [1, 2, 0, 3]
    assert logprob == pytest.approx(log_softmax(x)[0], abs=1e-6)


# --- batches -------------------------------------------------------------------------


@dataclass
class Row:
    params: SamplingParams
    rng: np.random.Generator
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def test_sample_rows_matches_one_row_at_a_time():
    logits = np.stack([random_logits(s) for s in range(6)])  # one padded row at the end
    params = [
        SamplingParams(temperature=0),
        SamplingParams(seed=1),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(top_k=5, seed=2),
        SamplingParams(temperature=0, repetition_penalty=3.0),
    ]
    make_rows = lambda: [Row(p, make_generator(p.seed), [0, 1], [int(np.argmax(logits[i]))]) for i, p in enumerate(params)]
    sampler = Sampler(eos_token_ids=[0])
    batched = sampler.sample_rows(logits, make_rows())
    single = [sampler.sample(logits[i], r.params, r.rng, r.output_ids, r.prompt_ids) for i, r in enumerate(make_rows())]
    assert batched == single
    assert batched[0].token_id == int(np.argmax(logits[0]))
    assert batched[4].token_id != int(np.argmax(logits[4]))


def test_logit_bias_moves_the_choice_and_leaves_logprobs_the_models():
    logits = random_logits(3)
    best = int(np.argmax(logits))
    other = (best + 1) % V
    sampler = Sampler()
    assert sampler.sample(logits, SamplingParams(temperature=0), make_generator(0)).token_id == best
    biased = SamplingParams(temperature=0, logit_bias={other: 100.0, best: -100.0}, logprobs=1)
    result = sampler.sample(logits, biased, make_generator(0))
    assert result.token_id == other
    assert result.logprob == pytest.approx(compute_logprobs(logits, other, 0)[0])  # the raw model's
    banned = SamplingParams(temperature=1.0, seed=1, logit_bias={best: -100.0})
    draws = {sampler.sample(logits, banned, make_generator(s)).token_id for s in range(50)}
    assert best not in draws


def test_unset_fields_take_the_models_defaults_and_set_fields_keep_the_requests():
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 20}
    params = SamplingParams.from_kwargs(model_defaults=defaults, temperature=None, top_p=0.5, max_tokens=3)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.2, 0.5, 20, 3)
    assert SamplingParams.from_kwargs(temperature=None).temperature == 1.0  # no model defaults: OpenAI's


def test_a_models_defaults_are_checked_as_request_fields_are():
    values = {"temperature": 0.7, "top_k": 40.0, "do_sample": True, "max_length": 20, "min_p": None}
    assert model_generation_defaults(values, "g.json") == {"temperature": 0.7, "top_k": 40}
    for bad, words in (({"top_p": 1.5}, "g.json: top_p must be in (0, 1]"),
                       ({"temperature": "hot"}, "g.json: temperature must be a number"),
                       ({"top_k": 2.5}, "g.json: top_k must be a number"),
                       ({"repetition_penalty": True}, "g.json: repetition_penalty must be a number")):
        with pytest.raises(ValueError, match=re.escape(words)):
            model_generation_defaults(bad, "g.json")
